"""Generating text: tokenizer and chat template, sampling and constraints, the decode loop and
speculative decoding.
"""
