"""The ``shmhb`` command and the operator's tools: what runs on a host, never inside a
worker.

- the command: ``main`` (the parser and its subcommands; ``python -m shmhb`` and the
  ``shmhb`` script), ``boardopts`` (choosing the board), ``units`` (systemd units),
  ``sdnotify``, ``stopsignal``, ``pipes``;
- the node monitor: ``view`` (one read of a board), ``events`` (what changed),
  ``monitor`` and ``screen`` (the live view), ``check`` (a board's consistency),
  ``gc`` (removing boards nobody uses);
- the exporter: ``exporter``, ``httpserve``;
- router feeds: ``feed``, ``feeder``, ``routerapi``, ``instview``;
- ``demo``: a simulated cluster on loopback hosts.

May import every other layer of the package (but ``shmhb.vllm``), and rich and
prometheus_client.  The library never imports it.
"""
