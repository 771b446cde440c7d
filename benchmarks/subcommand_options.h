#pragma once

// Option parsing shared by the tools with subcommands (kvbench, kvllm).

#include <iostream>

#include <boost/program_options.hpp>

namespace kvtools {

/// Parses argv[2..] (after "tool subcommand") against opts, with --help
/// added; prints the help and returns false when it is asked for.
inline bool parse_subcommand(
        int argc,
        char** argv,
        boost::program_options::options_description& opts,
        boost::program_options::variables_map& vm) {
    opts.add_options()("help,h", "this help");
    boost::program_options::store(boost::program_options::parse_command_line(argc - 1, argv + 1, opts), vm);
    if (vm.count("help")) {
        std::cout << opts << "\n";
        return false;
    }
    boost::program_options::notify(vm);
    return true;
}

} // namespace kvtools
