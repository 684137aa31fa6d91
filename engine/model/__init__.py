"""The models in plain PyTorch: the target's decoder (`transformer.py`), the feature drafters'
heads (`eagle3.py`, `dflash.py`), their shapes read from config.json (`config.py`), and the KV
cache. Nothing here knows about drafting rounds or the compiled kernels."""
