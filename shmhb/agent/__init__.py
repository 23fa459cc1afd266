"""The host agent: the role that one process per host holds, running the local death
watch and the network half in one loop.

- ``role`` (``Agent``: election, takeover, stand-down), ``embedded`` (the agent run
  inside a worker that registered with ``agent=True``);
- ``loop`` (the poll loop and its components), ``writer`` (the header words the role
  holder writes), ``localwatch`` (local workers' deaths, from pidfds and silence).

May import: the top-level vocabulary modules, ``shmhb.board``, ``shmhb.net`` and this
folder.  Never ``shmhb.cli``, ``shmhb.testing`` or ``shmhb.vllm``.
"""
