"""Tests of the host agent (shmhb/agent/)."""
