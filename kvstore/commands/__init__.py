"""Sub-commands of ``kvstore``, one module each (discovered by ``kvstore.cli``)."""
