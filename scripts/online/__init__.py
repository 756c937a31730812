"""The online path: hidden states go to a Mooncake store while the server runs, not to files.
master.py starts a store on this host, stream.py reads the samples back as a trainer does,
demo.py runs the whole path on a tiny model."""
