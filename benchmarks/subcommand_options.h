#pragma once

// Option parsing and error reporting shared by the tools (kvbench, kvllm and
// the bench_* programs).

#include <algorithm>
#include <cctype>
#include <exception>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <typeinfo>
#include <vector>

#include <boost/program_options.hpp>

#include <kvindex/errors.h>

namespace kvtools {

/// Parses argv[1..] against opts, with --help added; prints the help and
/// returns false when it is asked for. Unknown options and bad values throw.
inline bool parse_options(
        int argc,
        char** argv,
        boost::program_options::options_description& opts,
        boost::program_options::variables_map& vm) {
    opts.add_options()("help,h", "this help");
    auto parsed = boost::program_options::parse_command_line(argc, argv, opts);
    boost::program_options::store(parsed, vm);
    // Boost reads "-1" into an unsigned option as 2^64 - 1 (a seed that is
    // not the one typed): refused
    for (const auto& o : parsed.options) {
        auto it = vm.find(o.string_key);
        if (it == vm.end() || it->second.empty()) {
            continue;
        }
        const std::type_info& t = it->second.value().type();
        bool is_unsigned = t == typeid(unsigned) || t == typeid(unsigned long) ||
                t == typeid(unsigned long long);
        for (const std::string& v : o.value) {
            if (is_unsigned && v.find('-') != std::string::npos) {
                throw std::invalid_argument("--" + o.string_key + " " + v + ": must be >= 0");
            }
        }
    }
    if (vm.count("help")) {
        std::cout << opts << "\n";
        return false;
    }
    boost::program_options::notify(vm);
    return true;
}

/// parse_options for argv[2..] (after "tool subcommand").
inline bool parse_subcommand(
        int argc,
        char** argv,
        boost::program_options::options_description& opts,
        boost::program_options::variables_map& vm) {
    return parse_options(argc - 1, argv + 1, opts, vm);
}

/// Runs a tool's body and turns an exception (an unknown option, a bad
/// value, an error from the library) into "tool: message" on stderr and exit
/// status 2, where an uncaught exception would abort with a core dump.
template <class Body>
int run_tool(const char* tool, Body&& body) {
    try {
        return body();
    } catch (const std::exception& e) {
        std::cerr << tool << ": " << kvindex::error_message(e) << "\n";
        return 2;
    }
}

/// Comma-separated values ("0,5,29", "0.1,0.5"); "" gives an empty list.
/// Throws naming the element that does not parse as T, an empty element
/// (a trailing comma included) and a repeated one: every list is a set of
/// choices (layers, contexts, tasks), and a repeat would be counted twice.
template <class T>
std::vector<T> parse_list(const std::string& s) {
    std::vector<T> out;
    if (!s.empty() && s.back() == ',') {
        throw std::invalid_argument("empty list element (trailing comma) in \"" + s + "\"");
    }
    std::stringstream ss(s);
    std::string item;
    while (std::getline(ss, item, ',')) {
        std::stringstream is(item);
        T v;
        if (!(is >> v) || !is.eof()) {
            throw std::invalid_argument("bad list element \"" + item + "\" in \"" + s + "\"");
        }
        if (std::find(out.begin(), out.end(), v) != out.end()) {
            throw std::invalid_argument("repeated list element \"" + item + "\" in \"" + s + "\"");
        }
        out.push_back(v);
    }
    return out;
}

} // namespace kvtools
