// grpc_loadgen: a closed-loop load generator for the Open Inference Protocol's gRPC API.
//
//   grpc_loadgen --address 127.0.0.1:PORT --mode unary|stream --concurrency N
//                (--seconds S [--warmup W] | --requests R) --request FILE
//                [--threads T] [--channels K] [--metadata 'key: value']...
//
// FILE holds one serialized inference.ModelInferRequest (protobuf bytes, no gRPC framing). N
// clients each keep exactly one request outstanding: in `unary` mode a client sends ModelInfer
// calls back to back; in `stream` mode it opens one ModelStreamInfer call and writes the next
// message once the previous one is answered. Clients are spread over T threads, each driving its
// clients through its own completion queue, and over K channels (default N: one connection per
// client, as wrk's connections; channels never share a connection).
//
// With --seconds, answers that arrive in the W seconds of warm-up are not measured, nor are those
// that arrive after the S measured seconds: once S is over no client sends again, and every
// request still outstanding is waited for (streams are half-closed and finished), so the server
// has answered exactly `total_ok` + `total_errors` requests when the program exits. With
// --requests, exactly R requests are sent in all and every one is measured.
//
// Prints one JSON line: rps, p50_ms, p90_ms, p99_ms (latency from sending a request to reading
// its answer), requests (answered in the measured window), errors (of those: a non-OK status, a
// stream's non-empty error_message, or an answer without outputs), client_cpu (this process's
// CPU time over the window / the window's wall time; 1.0 = one core busy), and the totals.

#include <grpcpp/grpcpp.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <limits>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "open_inference_grpc.grpc.pb.h"

namespace {

using Clock = std::chrono::steady_clock;
using inference::GRPCInferenceService;
using inference::ModelInferRequest;
using inference::ModelInferResponse;
using inference::ModelStreamInferResponse;

// How long one unary call, or a stream beyond the end of the run, may take before it fails; with
// --requests a stream may last kFixedCountStreamTimeout.
constexpr auto kCallTimeout = std::chrono::seconds(30);
constexpr auto kFixedCountStreamTimeout = std::chrono::seconds(600);
constexpr auto kConnectTimeout = std::chrono::seconds(10);

struct Options {
  std::string address;
  std::string mode;
  int concurrency = 0;
  double seconds = 0;
  double warmup = 0;
  int64_t requests = 0;
  int threads = 1;
  int channels = 0;
  std::string request_file;
  std::vector<std::pair<std::string, std::string>> metadata;
};

[[noreturn]] void Usage(const std::string& why) {
  std::cerr << "grpc_loadgen: " << why << "\n"
            << "usage: grpc_loadgen --address HOST:PORT --mode unary|stream --concurrency N\n"
            << "                    (--seconds S [--warmup W] | --requests R) --request FILE\n"
            << "                    [--threads T] [--channels K] [--metadata 'key: value']...\n";
  std::exit(2);
}

double ParseNumber(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  double value = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || !std::isfinite(value) || value < 0) {
    Usage(flag + " needs a number >= 0, got '" + text + "'");
  }
  return value;
}

int64_t ParseCount(const std::string& flag, const std::string& text) {
  double value = ParseNumber(flag, text);
  if (value != std::floor(value) || value > 1e15) Usage(flag + " needs a whole number");
  return static_cast<int64_t>(value);
}

Options ParseArgs(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") Usage("closed-loop gRPC load (see the source's header)");
    if (i + 1 >= argc) Usage(flag + " needs a value");
    std::string value = argv[++i];
    if (flag == "--address") {
      o.address = value;
    } else if (flag == "--mode") {
      o.mode = value;
    } else if (flag == "--concurrency") {
      o.concurrency = static_cast<int>(ParseCount(flag, value));
    } else if (flag == "--seconds") {
      o.seconds = ParseNumber(flag, value);
    } else if (flag == "--warmup") {
      o.warmup = ParseNumber(flag, value);
    } else if (flag == "--requests") {
      o.requests = ParseCount(flag, value);
    } else if (flag == "--threads") {
      o.threads = static_cast<int>(ParseCount(flag, value));
    } else if (flag == "--channels") {
      o.channels = static_cast<int>(ParseCount(flag, value));
    } else if (flag == "--request") {
      o.request_file = value;
    } else if (flag == "--metadata") {
      auto colon = value.find(':');
      if (colon == std::string::npos || colon == 0) Usage("--metadata needs 'key: value'");
      std::string key = value.substr(0, colon);
      std::transform(key.begin(), key.end(), key.begin(), ::tolower);
      std::string val = value.substr(colon + 1);
      val.erase(0, val.find_first_not_of(' '));
      o.metadata.emplace_back(key, val);
    } else {
      Usage("unknown option " + flag);
    }
  }
  if (o.address.empty()) Usage("--address is required");
  if (o.mode != "unary" && o.mode != "stream") Usage("--mode must be unary or stream");
  if (o.concurrency < 1) Usage("--concurrency must be at least 1");
  if (o.request_file.empty()) Usage("--request is required");
  if ((o.seconds > 0) == (o.requests > 0)) Usage("give either --seconds or --requests");
  if (o.requests > 0 && o.warmup > 0) Usage("--warmup goes with --seconds only");
  if (o.threads < 1) Usage("--threads must be at least 1");
  o.threads = std::min(o.threads, o.concurrency);
  if (o.channels == 0) o.channels = o.concurrency;
  if (o.channels < 1 || o.channels > o.concurrency) Usage("--channels must be 1..concurrency");
  return o;
}

double CpuSeconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  auto seconds = [](const timeval& t) { return t.tv_sec + t.tv_usec / 1e6; };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

// What every client reads: the run's time window and, with --requests, how many are left to send.
struct Run {
  Clock::time_point measure_from;
  Clock::time_point measure_until;
  bool fixed_count = false;
  std::atomic<int64_t> budget{0};
  std::vector<std::pair<std::string, std::string>> metadata;

  // Whether a client may send one more request now; takes it from the budget if there is one.
  bool MayIssue(Clock::time_point now) {
    if (fixed_count) return budget.fetch_sub(1, std::memory_order_relaxed) > 0;
    return now < measure_until;
  }
  bool Measured(Clock::time_point done) const {
    return fixed_count || (done >= measure_from && done < measure_until);
  }
};

// One thread's counts; merged when every thread is done.
struct Stats {
  int64_t ok = 0;
  int64_t errors = 0;
  int64_t total_ok = 0;
  int64_t total_errors = 0;
  int64_t stream_restarts = 0;
  std::vector<int64_t> latencies_ns;
  std::string first_error;
  Clock::time_point last_done{};

  void Record(const Run& run, Clock::time_point sent, Clock::time_point done, bool good,
              const std::string& error) {
    (good ? total_ok : total_errors) += 1;
    if (!good && first_error.empty()) first_error = error;
    last_done = std::max(last_done, done);
    if (!run.Measured(done)) return;
    (good ? ok : errors) += 1;
    auto latency = std::chrono::duration_cast<std::chrono::nanoseconds>(done - sent);
    latencies_ns.push_back(latency.count());
  }
};

// Why an answer is not a usable inference answer, or "" when it is.
std::string Malformed(const ModelInferResponse& response) {
  if (response.outputs_size() == 0) return "an answer without outputs";
  if (response.raw_output_contents_size() == 0 && !response.outputs(0).has_contents()) {
    return "an answer whose output has no data";
  }
  return "";
}

std::string StatusText(const grpc::Status& status) {
  return "status " + std::to_string(static_cast<int>(status.error_code())) + ": " +
         status.error_message();
}

class Client;

// A completion-queue tag: which client, which of its operations.
struct Tag {
  Client* client;
  int op;
};

class Client {
 public:
  Client(GRPCInferenceService::Stub* stub, grpc::CompletionQueue* cq, Run* run, Stats* stats,
         const ModelInferRequest* request)
      : stub_(stub), cq_(cq), run_(run), stats_(stats), request_(request) {}
  virtual ~Client() = default;
  virtual void Start() = 0;
  virtual void Proceed(int op, bool ok) = 0;
  bool finished() const { return finished_; }

 protected:
  std::unique_ptr<grpc::ClientContext> NewContext(Clock::duration timeout) {
    auto ctx = std::make_unique<grpc::ClientContext>();
    for (const auto& [key, value] : run_->metadata) ctx->AddMetadata(key, value);
    ctx->set_deadline(std::chrono::system_clock::now() +
                      std::chrono::duration_cast<std::chrono::system_clock::duration>(timeout));
    return ctx;
  }
  void* TagFor(int op) {
    tags_[op] = Tag{this, op};
    return &tags_[op];
  }

  GRPCInferenceService::Stub* stub_;
  grpc::CompletionQueue* cq_;
  Run* run_;
  Stats* stats_;
  const ModelInferRequest* request_;
  Tag tags_[5];
  bool finished_ = false;
};

// ModelInfer calls back to back.
class UnaryClient : public Client {
 public:
  using Client::Client;
  void Start() override { Issue(Clock::now()); }

  void Proceed(int /*op*/, bool /*ok*/) override {
    auto done = Clock::now();
    std::string error = status_.ok() ? Malformed(response_) : StatusText(status_);
    stats_->Record(*run_, sent_, done, error.empty(), error);
    Issue(done);
  }

 private:
  void Issue(Clock::time_point now) {
    if (!run_->MayIssue(now)) {
      finished_ = true;
      return;
    }
    context_ = NewContext(kCallTimeout);
    response_.Clear();
    sent_ = Clock::now();
    reader_ = stub_->PrepareAsyncModelInfer(context_.get(), *request_, cq_);
    reader_->StartCall();
    reader_->Finish(&response_, &status_, TagFor(0));
  }

  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientAsyncResponseReader<ModelInferResponse>> reader_;
  ModelInferResponse response_;
  grpc::Status status_;
  Clock::time_point sent_;
};

// One ModelStreamInfer call, one message in flight: the next is written once the last is read.
// A stream that breaks counts its outstanding request as an error and is opened again.
class StreamClient : public Client {
 public:
  using Client::Client;
  void Start() override { Open(Clock::now()); }

  void Proceed(int op, bool ok) override {
    switch (op) {
      case kStart:
        if (ok) {
          Send();
        } else {
          broken_ = true;
          stream_->Finish(&status_, TagFor(kFinish));
        }
        break;
      case kWrite:
        write_done_ = true;
        if (read_done_) Answered();
        break;
      case kRead:
        read_done_ = true;
        read_ok_ = ok;
        if (write_done_) Answered();
        break;
      case kWritesDone:
        stream_->Finish(&status_, TagFor(kFinish));
        break;
      case kFinish:
        Finished();
        break;
    }
  }

 private:
  enum { kStart, kWrite, kRead, kWritesDone, kFinish };

  void Open(Clock::time_point now) {
    // The stream's first request is taken from the budget here, so a stream opens only to send.
    if (!run_->MayIssue(now)) {
      finished_ = true;
      return;
    }
    Clock::duration timeout = kFixedCountStreamTimeout;
    if (!run_->fixed_count) {
      timeout = std::max(run_->measure_until - now, Clock::duration{}) + kCallTimeout;
    }
    context_ = NewContext(timeout);
    stream_ = stub_->PrepareAsyncModelStreamInfer(context_.get(), cq_);
    broken_ = false;
    sent_ = now;
    stream_->StartCall(TagFor(kStart));
  }

  void Send() {
    write_done_ = read_done_ = read_ok_ = false;
    response_.Clear();
    sent_ = Clock::now();
    stream_->Write(*request_, TagFor(kWrite));
    stream_->Read(&response_, TagFor(kRead));
  }

  // Both the write and the read of the message in flight have completed.
  void Answered() {
    auto done = Clock::now();
    if (!read_ok_) {  // the stream ended without answering: its status says why
      broken_ = true;
      stream_->Finish(&status_, TagFor(kFinish));
      return;
    }
    std::string error = !response_.error_message().empty()
                            ? "error_message: " + response_.error_message()
                            : Malformed(response_.infer_response());
    stats_->Record(*run_, sent_, done, error.empty(), error);
    if (run_->MayIssue(done)) {
      Send();
    } else {
      stream_->WritesDone(TagFor(kWritesDone));
    }
  }

  void Finished() {
    auto done = Clock::now();
    if (broken_) {
      std::string why = status_.ok() ? "the stream ended without an answer" : StatusText(status_);
      stats_->Record(*run_, sent_, done, false, why);
      stats_->stream_restarts += 1;
      Open(done);
    } else {
      if (!status_.ok() && stats_->first_error.empty()) {
        stats_->first_error = "closing the stream: " + StatusText(status_);
      }
      finished_ = true;
    }
  }

  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientAsyncReaderWriter<ModelInferRequest, ModelStreamInferResponse>>
      stream_;
  ModelStreamInferResponse response_;
  grpc::Status status_;
  Clock::time_point sent_;
  bool write_done_ = false;
  bool read_done_ = false;
  bool read_ok_ = false;
  bool broken_ = false;
};

// One thread: its clients, driven through its completion queue until all of them are done.
void Drive(std::vector<std::unique_ptr<Client>>* clients, grpc::CompletionQueue* cq) {
  size_t active = clients->size();
  for (auto& client : *clients) {
    client->Start();
    if (client->finished()) --active;
  }
  void* tag = nullptr;
  bool ok = false;
  while (active > 0 && cq->Next(&tag, &ok)) {
    auto* t = static_cast<Tag*>(tag);
    t->client->Proceed(t->op, ok);
    if (t->client->finished()) --active;
  }
  cq->Shutdown();
  while (cq->Next(&tag, &ok)) {
  }
}

double Percentile(const std::vector<int64_t>& sorted, double p) {
  if (sorted.empty()) return 0.0;
  double rank = p / 100.0 * static_cast<double>(sorted.size() - 1);  // as numpy's "linear"
  auto below = static_cast<size_t>(std::floor(rank));
  size_t above = std::min(below + 1, sorted.size() - 1);
  double frac = rank - static_cast<double>(below);
  return static_cast<double>(sorted[below]) * (1 - frac) +
         static_cast<double>(sorted[above]) * frac;
}

std::string JsonString(const std::string& text) {
  std::ostringstream out;
  out << '"';
  for (unsigned char c : text) {
    if (c == '"' || c == '\\') {
      out << '\\' << c;
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out << buf;
    } else {
      out << c;
    }
  }
  out << '"';
  return out.str();
}

}  // namespace

int main(int argc, char** argv) {
  Options o = ParseArgs(argc, argv);

  ModelInferRequest request;
  {
    std::ifstream file(o.request_file, std::ios::binary);
    if (!file) Usage("cannot read " + o.request_file);
    std::string bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
    if (!request.ParseFromString(bytes) || request.model_name().empty()) {
      Usage(o.request_file + " is not a serialized ModelInferRequest with a model_name");
    }
  }

  // One connection per channel: a local subchannel pool keeps channels from sharing one.
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::vector<std::unique_ptr<GRPCInferenceService::Stub>> stubs;
  for (int i = 0; i < o.channels; ++i) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, -1);
    args.SetInt(GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, -1);
    auto channel =
        grpc::CreateCustomChannel(o.address, grpc::InsecureChannelCredentials(), args);
    if (!channel->WaitForConnected(std::chrono::system_clock::now() + kConnectTimeout)) {
      std::cerr << "grpc_loadgen: cannot connect to " << o.address << "\n";
      return 1;
    }
    stubs.push_back(GRPCInferenceService::NewStub(channel));
    channels.push_back(std::move(channel));
  }

  Run run;
  run.metadata = o.metadata;
  run.fixed_count = o.requests > 0;
  run.budget = o.requests;
  auto start = Clock::now();
  auto to_clock = [](double s) {
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
  };
  run.measure_from = start + to_clock(o.warmup);
  run.measure_until =
      run.fixed_count ? Clock::time_point::max() : run.measure_from + to_clock(o.seconds);

  std::vector<grpc::CompletionQueue> queues(o.threads);
  std::vector<Stats> stats(o.threads);
  std::vector<std::vector<std::unique_ptr<Client>>> clients(o.threads);
  for (int i = 0; i < o.concurrency; ++i) {
    int t = i % o.threads;
    auto* stub = stubs[i % o.channels].get();
    if (o.mode == "unary") {
      clients[t].push_back(
          std::make_unique<UnaryClient>(stub, &queues[t], &run, &stats[t], &request));
    } else {
      clients[t].push_back(
          std::make_unique<StreamClient>(stub, &queues[t], &run, &stats[t], &request));
    }
  }

  double cpu_from = CpuSeconds();
  std::vector<std::thread> threads;
  for (int t = 0; t < o.threads; ++t) threads.emplace_back(Drive, &clients[t], &queues[t]);
  double window_s;
  double cpu_s;
  if (run.fixed_count) {
    for (auto& thread : threads) thread.join();
    cpu_s = CpuSeconds() - cpu_from;
    Clock::time_point last = start;
    for (const auto& s : stats) last = std::max(last, s.last_done);
    window_s = std::chrono::duration<double>(last - start).count();
  } else {
    std::this_thread::sleep_until(run.measure_from);
    cpu_from = CpuSeconds();
    std::this_thread::sleep_until(run.measure_until);
    cpu_s = CpuSeconds() - cpu_from;
    window_s = o.seconds;
    for (auto& thread : threads) thread.join();
  }

  Stats all;
  for (auto& s : stats) {
    all.ok += s.ok;
    all.errors += s.errors;
    all.total_ok += s.total_ok;
    all.total_errors += s.total_errors;
    all.stream_restarts += s.stream_restarts;
    if (all.first_error.empty()) all.first_error = s.first_error;
    all.latencies_ns.insert(all.latencies_ns.end(), s.latencies_ns.begin(), s.latencies_ns.end());
  }
  std::sort(all.latencies_ns.begin(), all.latencies_ns.end());
  int64_t answered = all.ok + all.errors;
  double rps = window_s > 0 ? static_cast<double>(answered) / window_s : 0.0;

  std::printf(
      "{\"rps\": %.1f, \"p50_ms\": %.3f, \"p90_ms\": %.3f, \"p99_ms\": %.3f, \"requests\": %lld, "
      "\"errors\": %lld, \"client_cpu\": %.3f, \"seconds\": %.3f, \"total_ok\": %lld, "
      "\"total_errors\": %lld, \"stream_restarts\": %lld, \"mode\": \"%s\", \"concurrency\": %d, "
      "\"channels\": %d, \"threads\": %d, \"first_error\": %s}\n",
      rps, Percentile(all.latencies_ns, 50) / 1e6, Percentile(all.latencies_ns, 90) / 1e6,
      Percentile(all.latencies_ns, 99) / 1e6, static_cast<long long>(answered),
      static_cast<long long>(all.errors), window_s > 0 ? cpu_s / window_s : 0.0, window_s,
      static_cast<long long>(all.total_ok), static_cast<long long>(all.total_errors),
      static_cast<long long>(all.stream_restarts), o.mode.c_str(), o.concurrency, o.channels,
      o.threads, all.first_error.empty() ? "null" : JsonString(all.first_error).c_str());
  return 0;
}
