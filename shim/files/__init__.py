"""File trees and byte streams: tar archives, a container's writable layer, zstd, the upload pipes."""
