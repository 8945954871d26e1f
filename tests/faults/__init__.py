"""The fault matrix: faults injected between the clients and the test S3 server."""
