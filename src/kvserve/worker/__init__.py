"""Device-side work: input tensors, the model, the KV pool, sampling."""
