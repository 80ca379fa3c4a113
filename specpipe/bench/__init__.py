"""Benchmark clients: prompt data sets and the serving benchmark (`specpipe bench serve`)."""
