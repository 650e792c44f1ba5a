"""Evaluation (``orthros-eval``): needle in a haystack, MQAR recall, perplexity per position bucket,
the lm-eval adapter, and the prefill/decode benchmark against a dense model of the same shape."""
