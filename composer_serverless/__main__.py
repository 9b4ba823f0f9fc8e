"""``python -m composer_serverless`` is the ``composer-serverless`` command."""

from composer_serverless.cli import main

main()
