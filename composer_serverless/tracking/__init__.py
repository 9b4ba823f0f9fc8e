"""Experiment trackers (TensorBoard, trackio, W&B): the launcher relays the run's metrics from the store to
them (``relay.py``), turning the replicas' rows into points (``series.py``) for each tracker's own client
(``trackers.py``)."""
