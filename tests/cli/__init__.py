"""Tests of the command and the operator tools (shmhb/cli/)."""
