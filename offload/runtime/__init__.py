"""DeepSpeed's ``deepspeed.runtime`` names a script imports (``deepspeed.runtime.zero.offload_config``), over the
engine: the import swap reaches them as ``offload.runtime``."""
