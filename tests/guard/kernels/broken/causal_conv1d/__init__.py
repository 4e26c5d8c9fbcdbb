"""Test double: a causal-conv1d whose compiled extension does not load, as after a torch upgrade."""
raise ImportError("/opt/ftimage/venv/lib/python3.11/site-packages/causal_conv1d_cuda.cpython-311-x86_64-linux-gnu.so: "
                  "undefined symbol: _ZN3c104cuda9SetDeviceEa")
