"""The ops the model calls, each implemented per device (see docs/DESIGN.md, "Kernels")."""
