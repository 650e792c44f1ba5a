"""Serving exported Orthros models in vLLM.

``plugin.register`` (the ``vllm.general_plugins`` entry point) registers the model class and the
``orthros`` config with vLLM and transformers; ``model.py`` is the vLLM model (imported lazily by
vLLM, so nothing here imports vLLM at package import); ``output_rows.py`` plans which rows of a
step carry output tokens; ``prompt_logprobs.py`` tells the model which requests want prompt
logprobs; ``paged_attention.py`` is the output stream's attention over vLLM's GPU paged KV cache as
a Triton kernel (torch + triton only).
"""
