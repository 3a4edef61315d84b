"""``deepspeed.runtime.zero``'s names a script imports."""
