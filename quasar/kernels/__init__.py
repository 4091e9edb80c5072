"""The C++ kernels (`csrc/`) and `ext`, which builds, caches and loads their one extension
library and names the kernel path that runs."""
