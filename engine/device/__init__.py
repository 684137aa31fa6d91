"""Devices: which device and dtype a name means (`resolve.py`), what may be done on each
(`backend.py`), and forwards captured as graphs where the backend has them (`graphs.py`)."""
