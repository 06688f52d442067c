"""Device ops: one module per op.

Each module holds the NumPy reference of its op (what the ``cpu`` backend runs, float32) and,
beside it, the ``numba.cuda`` kernel with its validating launcher for the ``cuda`` backend.
Importing this package imports NumPy only; kernels compile on first launch.
"""
