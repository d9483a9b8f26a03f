"""Engines that load kvstore as their KV cache tier.

- ``kvstore.integrations.vllm``: ``KVStoreConnector``, a vLLM KV connector (v1) named in
  ``--kv-transfer-config`` by ``kv_connector_module_path``. Imports vLLM; nothing else in kvstore
  does.
- ``kvstore.integrations.tiny_model``: a tiny random-weight Llama and a locally trained
  tokenizer, for tests and benchmarks that need a real engine without a model hub.
"""
