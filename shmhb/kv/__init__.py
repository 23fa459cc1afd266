"""What the KV-transfer wrappers of several serving stacks share (vLLM's connector in
``shmhb.vllm``, SGLang's Mooncake backend in ``shmhb.sglang``): the go-ahead fence that
keeps a producer from writing into blocks its consumer gave up (``fence``, its wire
``fencewire`` and ``grants``) and the consumer's table of loads (``loads``).  Imports no
serving stack."""
