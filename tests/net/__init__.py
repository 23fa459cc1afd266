"""Tests of the network half (shmhb/net/)."""
