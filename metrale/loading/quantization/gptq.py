"""GPTQ (``quant_method: "gptq"``) and AWQ (``quant_method: "awq"``) checkpoints."""
