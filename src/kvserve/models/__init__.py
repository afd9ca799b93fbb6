"""Model architectures; ``registry.build_model`` picks one by name."""
