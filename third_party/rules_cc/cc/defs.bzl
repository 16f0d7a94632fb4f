# A minimal offline stand-in for @rules_cc: Bazel 4's own C++ toolchain files
# load these names from it; they forward to the native rules. (Debian's
# bazel-rules-cc is too new for bazel-bootstrap 4.2.)
def cc_library(**kwargs):
    native.cc_library(**kwargs)

def cc_binary(**kwargs):
    native.cc_binary(**kwargs)

def cc_test(**kwargs):
    native.cc_test(**kwargs)

def cc_toolchain(**kwargs):
    native.cc_toolchain(**kwargs)

def cc_toolchain_suite(**kwargs):
    native.cc_toolchain_suite(**kwargs)
