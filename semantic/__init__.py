"""semantic: exact-response and guarded semantic caches (built in the response-caches issue).

A library: never imports `gateway`, never reads HTTP headers; returns typed results.
"""
