"""Tests of the test seams (shmhb/testing/)."""
