"""The engine at run time: the model's forward pass, the engine that loads and steps it, the KV cache, the
device protocols and the engine's report. Its backends and memory tiers are engine/backends and engine/tiers.
"""
