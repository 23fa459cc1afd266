"""Tests of the board (shmhb/board/)."""
