"""Figures measured on this machine and the model: the host and link rates placement starts from,
layer-skip calibrations, perplexity and KL divergence.
"""
