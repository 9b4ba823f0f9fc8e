"""Launch backends behind one protocol (see ``base.py``)."""
