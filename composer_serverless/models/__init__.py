"""The model and tokenizer: loading a Hub id or a local directory, the tiny demo model, LoRA, saving in a dtype
(``loading.py``); and the check run before launch, in a child process, that the model, its tokenizer and
chat template can serve the configured objective (``check.py``)."""
