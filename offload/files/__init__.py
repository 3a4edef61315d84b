"""Weights and checkpoints on disk: the checkpoint format, streaming safetensors / torch.save writers, pretrained
weights read into shards, and plain weights exported from a checkpoint."""
