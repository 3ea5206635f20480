"""vitserve.encoder: the model side (images, keys, family adapters, batching, engine).

Imports torch, transformers, pillow and safetensors; never Ray, Redis or HTTP code.
"""
