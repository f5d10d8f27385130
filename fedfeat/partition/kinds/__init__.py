"""The partition schemes, one module each (``fedfeat.partition.registry.discover`` imports them all, by module
name; each registers its class with ``@register_scheme``). A new scheme is a new module here plus its test."""
