from ._native import Endpoint as Endpoint, last_error as last_error

__all__ = ["Endpoint", "last_error"]
