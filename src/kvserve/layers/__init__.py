"""Model building blocks shared by the architectures in ``kvserve.models``."""
