"""Array-level ops, one module per op: validate, dispatch by array type, launch a kernel (or run
the CPU reference). The functions are exported at the top level (``cukit.bias_act``); this package
holds the modules (``cukit.ops.bias_act``), so it re-exports no names that would shadow them."""
