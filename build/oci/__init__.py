"""Assemble the runtime image in Python, with no Dockerfile and no `docker build`.

The image is a stack of content-addressed layers, each a deterministic tarball written by
this tool (tarlayer.py) and cached by the digest of its inputs (layercache.py):

  base     the runtime base's root filesystem, setuid bits cleared, pip's bootstrap wheels
           dropped, the training user and /workspace added (baselayer.py)
  venv     the hash-locked wheels installed with `installer`, checked-hash .pyc compiled by
           the base's own interpreter (venv.py)
  lock     /etc/ftimage: the build lock and the SBOM
  app      /opt/ftimage: the image's own code and the gate script

The config and manifest are canonical JSON (image.py), so the same inputs give the same
image ID and manifest digest on any machine; an OCI image layout is written to the build's
output folder, the engine gets the image as a docker-archive (docker_archive.py), and a push
sends the same blobs through the registry API (build/publish/registry.py).
"""
