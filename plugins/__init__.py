"""Built-in plugins: the model families and the stage plugins.

They register through the same public API a third-party plugin uses.
"""
