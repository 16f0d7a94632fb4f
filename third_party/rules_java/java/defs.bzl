# Offline stand-in for @rules_java (see third_party/rules_cc/cc/defs.bzl):
# Bazel 4's registered JDK toolchains load these names; they forward to the
# native rules. Nothing in mok_jax builds Java.
def java_binary(**kwargs):
    native.java_binary(**kwargs)

def java_import(**kwargs):
    native.java_import(**kwargs)

def java_runtime(**kwargs):
    native.java_runtime(**kwargs)

def java_toolchain(**kwargs):
    native.java_toolchain(**kwargs)
