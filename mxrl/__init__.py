"""mxrl: low-precision RL for mixture-of-experts LMs with one precision contract."""

__version__ = "0.1.0"
