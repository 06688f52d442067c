"""Reading a checkpoint: the safetensors folder and its ``config.json``
(:mod:`metrale.loading.checkpoint`), typed config fields (:mod:`metrale.loading.config_fields`),
rotary-embedding scaling (:mod:`metrale.loading.rope`) and LoRA adapter folders
(:mod:`metrale.loading.lora`)."""
