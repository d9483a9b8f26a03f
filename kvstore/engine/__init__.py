"""The engine side: everything that runs in or beside an inference engine, by role.

Import the modules directly: this package imports nothing, and torch is imported only when a
worker, swap-in or gather is built (the fetcher process never imports it).

vLLM glue
  ``vllm``        ``KVStoreConnector``, the KV connector vLLM loads by name (``SupportsHMA``);
                  the only module here, with ``vllm_run``, that imports vLLM
  ``settings``    the connector's settings (``kv_connector_extra_config``) and engine layout
  ``vllm_run``    serve prompts in one engine and report what the connector did
Scheduler side (no tensors)
  ``groups``      an engine's KV-cache groups: what goes to which tier, the hit mode, refusals
  ``scheduler``   per request: one QueryHit with a lease, what to load and save each step
  ``plan``        what the scheduler side hands the worker side each step (plain data)
Worker side (the bytes)
  ``worker``      a step's loads and saves over the engine's KV tensors
  ``rows``        the engine's cache as per-layer block rows: which rows a load or save touches
  ``swapin``      the one load mechanism: staged layers → rows, off the engine thread
                  (a thread on CPU, a side stream and an event per layer on CUDA)
  ``save``        the one save mechanism: rows → host, off the engine thread (a gather thread
                  on CPU, a side stream on CUDA); the put thread assembles the payloads
  ``fetcher``     the fetcher process: reads, checks and stages loads layer by layer
  ``staging``     the /dev/shm staging area shared with the fetcher
  ``sharedkv``    a CPU engine's KV cache moved into shared memory: loads land in its rows
  ``kvlayout``    the byte map of a block payload and a window state, layer by layer
Test models
  ``tiny_model``  a tiny random Llama and a locally trained tokenizer
  ``tiny_gemma``  a tiny random Gemma-3 (sliding-window and full-attention layers)

The tier these read and write is reached through ``kvstore.tier`` (the cluster, files in a
directory, or the gRPC client).
"""
