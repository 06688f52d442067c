"""Device ops: one module per op.

Each module holds the NumPy reference of its op (what the ``cpu`` backend runs, float32); the
``numba.cuda`` kernel of the ``cuda`` backend, with its validating launcher, goes beside it.
Importing this package imports NumPy only.
"""
