"""What a finished run leaves: the trained model exported in Hugging Face's format (``export.py``), pushed to
the Hub (``hub.py``) with a model card that says how it was trained (``model_card.py``)."""
