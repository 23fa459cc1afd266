"""The network half of the host agent: one ZMQ pinger per host.

- the wire: ``protocol`` (the frames and their records, size-checked and validated,
  and their HMAC tag), ``exchange`` (nonces and push seqs: their counter and the replay guards);
- the sockets: ``transport`` (a ``TransportFactory``; ``shmhb.testing.network`` is the
  in-process one for tests), ``listener`` (the listening socket a holder that replaces
  a stopped one shares);
- what to ping and when: ``following`` (the followed hosts, from the board's watch
  table, and what each may speak for), ``plan`` (the ping budget);
- verdicts on hosts: ``suspicion``, ``evidence`` (a host's own pings, and the challenges
  that make them count without a secret); the rows written into the board:
  ``rowwriter``; answers to other hosts: ``responder``, ``digest``;
- trust: ``badinput`` (dropped frames, authentication failures);
- the half itself: ``pinger`` (``NetworkHalf``), run and restarted by ``supervisor``,
  with its settings stored in the board by ``settings`` and its state in ``state``.

May import: the top-level vocabulary modules, ``shmhb.board`` and this folder, and zmq.
Never ``shmhb.agent``, ``shmhb.cli``, ``shmhb.testing`` or ``shmhb.vllm``.
"""
