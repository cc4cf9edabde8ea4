__version__ = "0.3.1+fake"
