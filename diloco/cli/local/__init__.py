"""``diloco local``: ``config`` (LocalConfig, torch-free), ``supervisor`` (the processes),
``run`` (the driver: launch, watch, stop, summarise), ``progress`` (tables) and ``plots``."""
