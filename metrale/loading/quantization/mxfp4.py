"""MXFP4 (``quant_method: "mxfp4"``) checkpoints."""
